"""The projection kernel: what every table built from `events` shares, so that no kind keeps its own copy (decision
0049). `projection`: what a kind gives (`Projection`, `Kind`); `runner`: the one loop that updates any kind's table;
`position`: how far a table has folded `events`, read and committed with its rows; `feed`: `events`' change feed,
read once; `turn`: one update of a table at a time; `engine`: the engine rule; `result`: what an update did.
"""
