#!/bin/bash
cd /app
grep -rl --include='*.py' 'calc_total' shop | xargs sed -i 's/\bcalc_total\b/compute_total/g'
