"""Training a small model of the V4.1 architecture (issue 21): the data, its tokenizer, the training mode of
the model's own code (straight-through estimators for the FP8/FP4 fake quantisation) and the export to the
official checkpoint layout."""
