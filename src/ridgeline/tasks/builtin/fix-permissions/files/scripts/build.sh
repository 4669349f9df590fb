#!/bin/sh
echo building
