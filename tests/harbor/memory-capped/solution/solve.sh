#!/bin/bash
# More than the task's memory_mb: the trial's cgroup must stop it before the file is written.
python3 -c 'x = bytearray(300 << 20); print(len(x))' && echo "Hello, world!" > /app/hello.txt
