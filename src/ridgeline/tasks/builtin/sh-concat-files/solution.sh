#!/bin/bash
cat /app/a.txt /app/b.txt > /app/ab.txt
