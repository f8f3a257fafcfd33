"""The notebook side (DEVELOPING.md, box 9): what a kernel shows and does about its own GPU share.

:mod:`.actions` (``status``, ``gpus``, ``release``, ``request``: plain Python, for scripts),
:mod:`.panel` (the live ipywidgets panel with its Release button), :mod:`.magics` (``%gpushare``).
Re-exported lazily by :mod:`jupyter_gpushare` so that importing the package in the server stays
cheap (no ipywidgets, no IPython).
"""
