"""The trainer's runtime: Lingvo's runners, their state and the trainer's flags.

The one place that leans on Lingvo's private internals; each is listed in
`lingvo_ext/_internal/lingvo.py` and checked by tests/_internal/.
"""
