#!/bin/bash
sed -i 's/cat/dog/g' /app/pets.txt
