#!/bin/bash
printf 'red\ngreen\nblue\n' > /app/colors.txt
