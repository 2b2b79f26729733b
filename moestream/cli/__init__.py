"""The `moestream` command: main (the parser, run, info, make-model, serve), args (shared flags and checks),
perf (bench, profile, probe) and report (bench tables)."""
