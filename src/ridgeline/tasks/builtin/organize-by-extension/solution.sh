#!/bin/bash
cd /app
for f in inbox/*; do
    name=$(basename "$f")
    if [[ "$name" == *.* ]]; then
        ext=$(echo "${name##*.}" | tr 'A-Z' 'a-z')
    else
        ext=other
    fi
    mkdir -p "sorted/$ext"
    mv "$f" "sorted/$ext/$name"
done
