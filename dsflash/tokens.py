"""The V4.1 special tokens' strings: what the chat encoding writes and the tokenizer keeps whole.

At the bottom of the package so that the tokenizer and the chat encoding share them without the one
importing the other (the release's ids for them live in its tokenizer.json).
"""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
SYSTEM = "<｜System｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
