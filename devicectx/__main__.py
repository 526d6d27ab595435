"""``python -m devicectx``: the device report."""

from devicectx._cli import main

raise SystemExit(main())
