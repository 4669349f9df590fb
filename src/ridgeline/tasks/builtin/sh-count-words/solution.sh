#!/bin/bash
wc -w < /app/text.txt > /app/words.txt
