#!/bin/bash
cat > /app/pyramid.obj <<'OBJ'
v -2 -2 0
v 2 -2 0
v 2 2 0
v -2 2 0
v 0 0 3
# base, seen from below
f 1 4 3 2
# sides
f 1 2 5
f 2 3 5
f 3 4 5
f 4 1 5
OBJ
