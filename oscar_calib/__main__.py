"""`python -m oscar_calib` is the `oscar-calib` command."""

from oscar_calib.cli import main

main()
