#!/bin/bash
tr 'A-Z' 'a-z' < /app/shout.txt > /app/quiet.txt
