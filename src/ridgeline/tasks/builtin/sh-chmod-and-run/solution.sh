#!/bin/bash
chmod +x /app/greet.sh
/app/greet.sh > /app/greet_output.txt
