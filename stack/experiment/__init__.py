"""The learning experiment (`rolltap experiment`, `make learn`): issue #37. One module per
concept: templates and tasks (pure), check (grading), stats (pure), evaluation, servers,
training, parts, driver (resumable), report, cli."""
