"""The commands the README and docs/ show: set-up as CI runs it, every `keras-dist` line
accepted by the command line as written, and `keras-dist info` run."""

import re
import shlex
from pathlib import Path

import pytest

from runner import BIN, run
from keras_dist import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The placeholders the pages use for counts and indices.
PLACEHOLDERS = {"N": "2", "W": "2", "K": "1", "I": "0"}


def code_lines(page: Path) -> list[str]:
    """The lines of the page's fenced code blocks, without comments."""
    lines, inside = [], False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            inside = not inside
        elif inside and line.split("#", 1)[0].strip():
            lines.append(line.split("  #", 1)[0].strip())
    return lines


def keras_dist_commands() -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for line in code_lines(page):
            words = shlex.split(line)
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VARIABLE=value prefixes
                words.pop(0)
            if words and words[0] == "keras-dist":
                found.append((page.name, " ".join(PLACEHOLDERS.get(w, w) for w in words[1:])))
    return found


def test_the_readme_holds_the_two_set_up_commands_that_ci_runs():
    setup = [line for line in code_lines(ROOT / "README.md") if line.startswith("./dev.sh")]
    assert setup == ["./dev.sh train", "./dev.sh test"], setup
    assert "./dev.sh test" in (ROOT / ".ci" / "run").read_text()


@pytest.mark.parametrize("page, command", keras_dist_commands())
def test_every_keras_dist_command_shown_is_accepted_as_written(page, command):
    try:
        cli.parser().parse_args(shlex.split(command))
    except SystemExit:
        pytest.fail(f"{page}: `keras-dist {command}` is not a valid command line", pytrace=False)


def test_the_pages_show_launch_and_info_and_info_runs():
    commands = [command.split()[0] for _, command in keras_dist_commands()]
    assert "launch" in commands and "info" in commands, commands
    code, out = run([BIN / "keras-dist", "info"], timeout=120)
    assert code == 0 and "strategy" in out.lower(), out[-2000:]
