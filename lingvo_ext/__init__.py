"""lingvo_ext: GPipe pipeline parallelism and friends on Lingvo.

Importing it changes nothing in the process: the programs' entry point
(lingvo_ext/entry_point.py) sets up what they need.
"""
