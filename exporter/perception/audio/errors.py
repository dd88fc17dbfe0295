"""The one error type of the audio perception package."""


class AudioPerceptionError(ValueError):
    """A perception config, weight set or input this package cannot run; the message names what to change."""
