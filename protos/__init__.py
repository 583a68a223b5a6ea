"""Wire messages: `.proto` files and their generated code.

Regenerate with `python -m pdserve.protos.generate`; CI checks the committed code is current.
"""
