#!/bin/bash
echo 'good morning' > /app/greeting.txt
