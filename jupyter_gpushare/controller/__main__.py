"""``python -m jupyter_gpushare.controller``: run the cluster controller."""

from .app import main

main()
