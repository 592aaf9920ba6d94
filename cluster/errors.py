"""The launcher's error: a job that cannot start or go on, said in one line (cluster.start prints it, no
traceback)."""


class JobError(RuntimeError):
    pass
