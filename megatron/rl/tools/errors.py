"""The error a tool reports to the model."""


class ToolError(Exception):
    """A tool refused or failed a call; its message goes back to the model as the tool's result
    (never an error of the rollout)."""
