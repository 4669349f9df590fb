#!/bin/bash
find /app/logs -type f -name '*.log' | wc -l > /app/count.txt
