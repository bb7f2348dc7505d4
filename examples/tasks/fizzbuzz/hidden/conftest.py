# Replaces any conftest.py the agent wrote at the workdir root, which pytest would otherwise
# load into the verifier (and which could rewrite test outcomes).
