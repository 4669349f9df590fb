#!/bin/bash
find /app/data -type f -name '*.csv' | wc -l > /app/csv_count.txt
