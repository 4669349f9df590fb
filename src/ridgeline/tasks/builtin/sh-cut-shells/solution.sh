#!/bin/bash
cut -d: -f3 /app/users.txt > /app/shells.txt
