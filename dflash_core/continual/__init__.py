"""The continual job kind: a training run without an end that follows watched sources and
ingested records (sources.py, feed.py), mixes them with a bounded replay of older ones
(replay.py), and publishes the drafter when it beats the published one (publish.py); run.py is
its run (the protocol of engine/kinds.py)."""
