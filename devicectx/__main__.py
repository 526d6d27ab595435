"""``python -m devicectx``: the device report."""

from devicectx.devices._cli import main

raise SystemExit(main())
