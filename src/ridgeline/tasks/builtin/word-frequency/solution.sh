#!/bin/bash
cd /app
tr 'A-Z' 'a-z' < book.txt | tr -cs 'a-z' '\n' | grep -v '^$' | sort | uniq -c \
    | awk '{print $2, $1}' | sort -k2,2nr -k1,1 | head -n 5 > top_words.txt
