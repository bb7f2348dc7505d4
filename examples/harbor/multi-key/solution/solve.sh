#!/bin/bash
seq 1 3 > /app/count.txt
