"""The projection kernel: what every table built from `events` shares, so that no kind keeps its own copy (decision
0049). `position`: how far a table has folded `events`, read and committed with its rows; `feed`: `events`' change
feed, read once; `turn`: one update of a table at a time.
"""
