"""No work lost: backups, the preemption notice, and resuming where a job stopped.

A job is killed at any step (a lost machine, an out-of-memory kill) or told to stop (SIGTERM
from a spot VM, Kubernetes or SLURM; SIGUSR1 ahead of a SLURM time limit). `resume` makes a
Keras `BackupAndRestore` (the script's, or one keras_dist adds for `keras-dist launch
--backup-dir`) hold and restore the position inside the epoch, the order of its samples and
its metric states, so that a restarted `fit` goes on at the step after the backup and ends as
if never stopped. `background_writes` copies the state at the backup's step and writes it in
a thread; `atomic_writes` commits every file the chief writes (backups, checkpoints) by
rename, so a kill leaves the last whole one. `preemption` turns a notice into a save at a
step every process agrees on, then an exit (and a SLURM requeue). `keras_dist.training`
wires it into `fit`; the inputs start a resumed epoch at its position; the launchers pass
notices on and restart failed jobs (`keras-dist launch --max-restarts`). The script's own
saves, on every process, are written once by the chief: `script_saves` for the model's
`save`/`save_weights`/`export`, `tf_checkpoints` for TensorFlow's `tf.train.Checkpoint`.
How each engine writes `fit`'s checkpoints is the `CheckpointIO` its strategy declares
(`checkpoint_io`): where a save is a collective (MultiWorkerMirrored, sharded state), the
other processes run a stand-in of each file callback that saves into a scratch directory
(`scratch`).
"""
