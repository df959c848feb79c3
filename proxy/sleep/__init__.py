"""vLLM's sleep mode across the fleet: nodes drained then put to sleep (by the admin API or when their model is
idle), and woken on demand, one node per model at a time fleet-wide. marks.py (the record's mark) -> calls.py (a
node's admin routes) -> sleeper.py (drain, then sleep) and waker.py (wake one node) -> ondemand.py (the request
path's wait for a wake) and idle.py (sleep after idle); setup.py builds them for the app."""
