#!/bin/bash
tr 'a-z' 'A-Z' < /app/input.txt > /app/output.txt
