"""Tests of lingvo_ext/serving/: inference graphs and SavedModel export."""
