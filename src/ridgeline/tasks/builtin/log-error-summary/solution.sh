#!/bin/bash
cd /app
{
    echo "component,count"
    awk '$3 == "ERROR" { gsub(/[][]/, "", $4); n[$4]++ } END { for (c in n) print c "," n[c] }' app.log \
        | sort -t, -k2,2nr -k1,1
} > errors_by_component.csv
