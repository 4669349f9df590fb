#!/bin/bash
tail -n 2 /app/log.txt > /app/last.txt
