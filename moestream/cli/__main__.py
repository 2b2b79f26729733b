"""`python -m moestream.cli`: the `moestream` command without the installed script."""

from moestream.cli.main import entry

entry()
