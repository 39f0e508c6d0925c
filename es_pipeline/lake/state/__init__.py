"""State per stream: the fold through the team's reducers (`fold`), a state's JSON and back (`state_json`), the
first build without a JVM (`whole_fold`), `stream_state`, a typed table per declared state (`typed_state`),
and `snapshots`."""
