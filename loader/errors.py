"""Errors that name the file and the field or tensor at fault."""


class GGUFError(ValueError):
    """A GGUF file cannot be used; the message names the file and what is wrong."""

    def __init__(self, path: str, problem: str):
        self.path, self.problem = path, problem
        super().__init__(f"{path}: {problem}")
