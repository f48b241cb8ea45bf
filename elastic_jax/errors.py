"""The one exception type that user-facing code raises for bad input.

Its message is a single sentence naming the file, field or tensor at fault; the command-line
entry points print it and exit with status 2 instead of showing a traceback.
"""


class ElasticJaxError(ValueError):
  """Bad input: a malformed config, a broken checkpoint, an unsupported model or sequence."""
