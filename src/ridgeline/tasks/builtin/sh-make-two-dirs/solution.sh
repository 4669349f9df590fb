#!/bin/bash
mkdir /app/src /app/docs
