"""Errors a user can act on: they name the file and the problem."""


class ModelLoadError(ValueError):
    def __init__(self, path, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = str(path), problem
