#!/bin/bash
head -n 3 /app/log.txt > /app/first.txt
