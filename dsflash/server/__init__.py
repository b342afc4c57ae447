"""The HTTP server. Its limits by default, shared by `create_app` and the flags of `dsflash serve` (kept here,
so the command line gets them without importing the web stack)."""

MAX_BODY = 16 * 1024 ** 2  # bytes: a full context of text in JSON is far less; images come on top
MAX_QUEUE = 32  # generation requests waiting beyond the running ones
REQUEST_TIMEOUT_S = 30.0  # for a request's headers, and then for its body
SHUTDOWN_TIMEOUT_S = 10.0  # for running generations after SIGTERM
