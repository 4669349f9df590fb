#!/bin/bash
cut -d, -f1 /app/people.csv > /app/names.txt
