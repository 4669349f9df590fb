#!/bin/bash
wc -l < /app/names.txt > /app/count.txt
