#!/bin/bash
sort -u /app/visitors.txt > /app/unique.txt
