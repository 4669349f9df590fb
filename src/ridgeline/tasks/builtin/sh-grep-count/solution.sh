#!/bin/bash
grep -c FAIL /app/results.txt > /app/failures.txt
