#!/bin/bash
sed 's/NAME/Alice/g' /app/template.txt > /app/letter.txt
