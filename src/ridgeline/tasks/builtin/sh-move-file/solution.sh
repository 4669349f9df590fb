#!/bin/bash
mv /app/inbox/todo.txt /app/done/
