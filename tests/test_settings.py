"""keras_dist/settings.py: one declaration per variable, docs/settings.md made from it, values
checked once (who reads the process environment: tests/test_house.py)."""

import re

import pytest

from keras_dist import settings
from keras_dist.errors import KerasDistError
from keras_dist.settings import Settings

from runner import ROOT


def test_docs_settings_md_is_the_declared_table():
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert doc.endswith(settings.markdown_table()), "docs/settings.md differs from settings.VARIABLES: regenerate its table"


def test_every_keras_dist_variable_named_in_the_code_and_docs_is_declared():
    declared = {v.name for v in settings.VARIABLES}
    files = [*(ROOT / "keras_dist").rglob("*.py"), *(ROOT / "keras_dist").rglob("*.sh"), ROOT / "README.md",
             *(ROOT / "docs").glob("*.md")]
    named = {name for path in files for name in re.findall(r"KERAS_DIST_[A-Z_]*[A-Z]", path.read_text())}
    assert named - declared == set()
    assert len(declared) == len(settings.VARIABLES)  # one declaration each


def test_settings_are_read_from_a_mapping_with_their_defaults():
    assert Settings.from_environ({}) == Settings()
    chosen = Settings.from_environ({"KERAS_DIST_STEP_TIMEOUT": "5", "KERAS_DIST_LOG": "DEBUG", "KERAS_DIST_BIND_ALL": "1",
                                    "KERAS_DIST_SLURM_REQUEUE": "0", "KERAS_DIST_BACKUP_SECONDS": "",
                                    "KERAS_DIST_RESTART": "2", "KERAS_DIST_BACKEND": "jax"})
    assert (chosen.step_timeout, chosen.debug_log, chosen.bind_all, chosen.slurm_requeue, chosen.backup_seconds,
            chosen.restart, chosen.backend) == (5.0, True, True, False, 300.0, 2, "jax")


def test_the_job_secret_is_read_from_the_environment_or_a_file_its_owner_alone_may_read(tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cret\n")
    secret_file.chmod(0o600)
    assert Settings.from_environ({}).directory_secret() is None
    assert Settings.from_environ({"KERAS_DIST_JOB_SECRET": "abc"}).directory_secret() == b"abc"
    assert Settings.from_environ({"KERAS_DIST_JOB_SECRET_FILE": str(secret_file)}).directory_secret() == b"s3cret"
    assert "abc" not in repr(Settings.from_environ({"KERAS_DIST_JOB_SECRET": "abc"}))
    refused = {0o640: "may be read by its group or others (mode 640); chmod 600 it",
               0o604: "may be read by its group or others (mode 604); chmod 600 it"}
    for mode, said in refused.items():
        secret_file.chmod(mode)
        with pytest.raises(KerasDistError, match=re.escape(f"KERAS_DIST_JOB_SECRET_FILE='{secret_file}' {said}")):
            Settings.from_environ({"KERAS_DIST_JOB_SECRET_FILE": str(secret_file)}).directory_secret()
    secret_file.chmod(0o600)
    with pytest.raises(KerasDistError, match="set KERAS_DIST_JOB_SECRET or KERAS_DIST_JOB_SECRET_FILE, not both"):
        Settings.from_environ({"KERAS_DIST_JOB_SECRET": "abc",
                               "KERAS_DIST_JOB_SECRET_FILE": str(secret_file)}).directory_secret()
    with pytest.raises(KerasDistError, match="cannot be read \\(No such file or directory\\)"):
        Settings.from_environ({"KERAS_DIST_JOB_SECRET_FILE": str(tmp_path / "none")}).directory_secret()
    secret_file.write_text("\n")
    with pytest.raises(KerasDistError, match="is empty"):
        Settings.from_environ({"KERAS_DIST_JOB_SECRET_FILE": str(secret_file)}).directory_secret()


@pytest.mark.parametrize("name, value", [
    ("KERAS_DIST_STEP_TIMEOUT", "soon"), ("KERAS_DIST_STEP_TIMEOUT", "0"), ("KERAS_DIST_BUCKET_BYTES", "25MB"),
    ("KERAS_DIST_BACKUP_SECONDS", "-1"), ("KERAS_DIST_SLURM_REQUEUE", "no"), ("KERAS_DIST_BIND_ALL", "true"),
    ("KERAS_DIST_MIN_SHARD_BYTES", "0"), ("KERAS_DIST_RESTART", "x"), ("KERAS_DIST_INSECURE_DIRECTORY", "yes"),
])
def test_a_bad_value_is_a_one_line_error_naming_the_variable(name, value):
    with pytest.raises(KerasDistError, match=f"^{name}='{value}'") as error:
        Settings.from_environ({name: value})
    assert "\n" not in str(error.value)


def test_the_step_timeout_table_is_what_each_backend_declares():
    """docs/settings.md's per-backend table, row by row, from `ProcessSetup.applied_step_timeout`."""
    from keras_dist import strategies, timeouts

    expected = []
    for name in strategies.REGISTRY:
        cls = strategies.strategy_class(name)
        for label, policy in (("unset", timeouts.StepTimeout(120.0, 30.0, False)),
                              ("45", timeouts.StepTimeout(45.0, 45.0, True))):
            applied = cls.process_setup.applied_step_timeout(policy)
            if applied is not None:
                expected.append(f"| `{name}` | {label} | " + " | ".join(applied) + " |")
    doc = (ROOT / "docs" / "settings.md").read_text()
    table = doc[doc.index("| backend | `KERAS_DIST_STEP_TIMEOUT` |"):].split("\n\n")[0].splitlines()[2:]
    assert table == expected
    assert timeouts.policy(Settings()) == timeouts.StepTimeout(120.0, 30.0, False)
    assert timeouts.policy(Settings(), 45) == timeouts.StepTimeout(45, 45, True)
    assert timeouts.policy(Settings(step_timeout=7)) == timeouts.StepTimeout(7, 7, True)
